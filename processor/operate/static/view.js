// Durable Check operator view: renders what /api/v1 answers (or, in a replay report, the
// data embedded in the page). Text only ever goes in through textContent: nothing from a
// span is parsed as HTML.
"use strict";
(function () {
  const WAIT_STATES = new Set(["awaiting_approval", "waiting_on_external", "retry_scheduled"]);
  const SEVERITIES = ["critical", "error", "warning", "info"];

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs || {})) {
      if (value === undefined || value === null || value === false) continue;
      if (key === "text") node.textContent = String(value);
      else if (key === "class") node.className = value;
      else node.setAttribute(key, value === true ? "" : String(value));
    }
    for (const child of children) {
      if (child === null || child === undefined) continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  function when(ns) {
    if (ns === null || ns === undefined) return "—";
    return new Date(Number(ns) / 1e6).toISOString().replace("T", " ").replace(/\.\d+Z$/, " UTC");
  }

  function span(seconds) {
    if (seconds === null || seconds === undefined) return "no deadline";
    const s = Math.abs(Math.round(seconds));
    const text = s >= 86400 ? `${Math.floor(s / 86400)}d ${Math.floor((s % 86400) / 3600)}h`
      : s >= 3600 ? `${Math.floor(s / 3600)}h ${Math.floor((s % 3600) / 60)}m`
      : s >= 60 ? `${Math.floor(s / 60)}m ${s % 60}s` : `${s}s`;
    return seconds < 0 ? `${text} overdue` : `${text} left`;
  }

  function sessionLink(id, base) {
    return el("a", { href: `${base}sessions/${encodeURIComponent(id)}`, class: "mono" }, id);
  }

  function badge(severity) {
    return el("span", { class: `badge sev-${severity}` }, severity);
  }

  function table(caption, headers, rows, empty) {
    if (!rows.length) return el("p", { class: "empty" }, empty);
    const head = el("tr", {}, ...headers.map((h) => el("th", { scope: "col" }, h)));
    return el("table", {}, el("caption", {}, caption), el("thead", {}, head), el("tbody", {}, ...rows));
  }

  function traceLink(setup, traceId) {
    if (!setup || !setup.trace_url || !traceId) return null;
    const href = setup.trace_url.replace("{trace_id}", encodeURIComponent(traceId));
    return el("a", { href, rel: "noopener noreferrer", target: "_blank" }, "Open trace in your tracing UI");
  }

  // -- views --------------------------------------------------------------------------------

  function renderWaiting(main, data, base, pager) {
    main.append(el("h1", {}, "Waiting now"));
    main.append(el("p", { class: "muted" },
      `${data.total} session(s) whose latest state is a wait. Expired waits first, then the oldest.`));
    const rows = data.items.map((w) => el("tr", { class: w.expired ? "expired" : "" },
      el("td", {}, sessionLink(w.session_id, base)),
      el("td", {}, el("span", { class: "state" }, w.state)),
      el("td", {}, waitFor(w)),
      el("td", {}, when(w.since_ns)),
      el("td", {}, when(w.deadline_ns)),
      el("td", { class: w.expired ? "overdue" : "" }, w.expired ? `EXPIRED, ${span(w.time_left_s)}` : span(w.time_left_s)),
      el("td", {}, waitFinding(w, base)),
      el("td", { class: "todo" }, waitTodo(w, data.rules || {})),
      el("td", {}, w.service || "—")));
    main.append(table("Sessions waiting",
      ["Session", "Waiting in", "For", "Since", "Deadline", "Time left", "Finding", "What to do", "Service"],
      rows, "Nothing is waiting."));
    if (pager) main.append(pager(data.items.length, data.total));
  }

  // The waiting action, named once: its id when the id already says the kind (approval:refund:call_1).
  function waitFor(w) {
    const id = w.action_id || "";
    const kind = w.kind || "action";
    return id.startsWith(`${kind}:`) || id.startsWith(kind) ? id : `${kind} ${id}`.trim();
  }

  // The finding a stuck wait already has: DS107 once its deadline passed, DS106 when it has none.
  function waitFinding(w, base) {
    const rule = w.expired ? "DS107" : (w.deadline_ns === null || w.deadline_ns === undefined ? "DS106" : null);
    if (!rule) return "—";
    const query = new URLSearchParams({ rule, session: w.session_id });
    return el("a", { href: `${base}violations?${query}` }, rule);
  }

  // What an operator can do about a wait, in the words of the wait rules' fixes: DS107 (resolve,
  // escalate or cancel) once the deadline passed, DS106 (give it one) when it has none.
  function waitTodo(w, rules) {
    const spans = Boolean(w.trace_id);
    const fixOf = (id) => ((rules[id] || {})[spans ? "fix_spans" : "fix_logs"]) || "";
    if (w.expired) return fixOf("DS107");
    if (w.deadline_ns === null || w.deadline_ns === undefined) return fixOf("DS106");
    const stuck = fixOf("DS107");
    return `Nothing yet: it has ${span(w.time_left_s).replace(" left", "")} before its deadline. If it is stuck, ${stuck.charAt(0).toLowerCase()}${stuck.slice(1)}`;
  }

  // A finding an operator's waiver or baseline accepts: shown, marked, with the reason on hover.
  function waivedMark(v) {
    const w = v.details && v.details.waived;
    return w ? [" ", el("span", { class: "badge waived", title: `${w.reason || ""} (${w.by || ""})` }, "waived")] : [];
  }

  function violationRows(items, base, withSession) {
    return items.map((v) => el("tr", {},
      el("td", {}, badge(v.severity), ...waivedMark(v)),
      el("td", {}, el("span", { class: "mono" }, v.rule), " ", v.name || ""),
      withSession ? el("td", {}, sessionLink(v.session_id, base)) : null,
      el("td", { class: "mono" }, v.action_id || "—"),
      el("td", {}, v.message),
      el("td", {}, when(v.time_unix_nano))));
  }

  function renderViolations(main, data, base, query, onFilter, pager) {
    main.append(el("h1", {}, "Violations"));
    const form = el("form", { class: "filters", role: "search", "aria-label": "Filter violations" });
    const ruleIds = Object.keys(data.rules || {}).sort();
    const ruleSelect = el("select", { id: "f-rule", name: "rule" }, el("option", { value: "" }, "any rule"),
      ...ruleIds.map((id) => el("option", { value: id, selected: query.rule === id }, `${id} ${data.rules[id].name}`)));
    const sevSelect = el("select", { id: "f-severity", name: "severity" }, el("option", { value: "" }, "any severity"),
      ...SEVERITIES.map((s) => el("option", { value: s, selected: query.severity === s }, s)));
    const sessionInput = el("input", { id: "f-session", name: "session", type: "text", value: query.session || "",
      autocomplete: "off", spellcheck: "false" });
    form.append(
      el("label", { for: "f-rule" }, "Rule"), ruleSelect,
      el("label", { for: "f-severity" }, "Severity"), sevSelect,
      el("label", { for: "f-session" }, "Session"), sessionInput,
      el("button", { type: "submit" }, "Apply filters"));
    form.addEventListener("submit", (event) => {
      event.preventDefault();
      onFilter({ rule: ruleSelect.value, severity: sevSelect.value, session: sessionInput.value.trim() });
    });
    main.append(form);
    const counts = (data.counts || []).map((c) => el("tr", {},
      el("td", { class: "mono" }, c.rule), el("td", {}, (data.rules[c.rule] || {}).name || ""),
      el("td", {}, badge(c.severity)), el("td", { class: "num" }, c.count)));
    main.append(el("section", { "aria-labelledby": "counts-h" }, el("h2", { id: "counts-h" }, "Counts by rule"),
      table("Violations by rule and severity", ["Rule", "Name", "Severity", "Count"], counts, "No violations yet.")));
    const waived = data.items.filter((v) => v.details && v.details.waived).length;
    main.append(el("section", { "aria-labelledby": "recent-h" }, el("h2", { id: "recent-h" }, "Recent"),
      waived ? el("p", { class: "waived-count" }, `${waived} of these are waived: accepted by the operator, not errors.`)
        : null,
      table("Recent violations, newest first", ["Severity", "Rule", "Session", "Action", "Message", "Time"],
        violationRows(data.items, base, true), "No violation matches.")));
    if (pager) main.append(pager(data.items.length, null));
  }

  function waitsOf(actions) {
    const waits = [];
    actions.forEach((a, i) => {
      if (!WAIT_STATES.has(a.workflow_state)) return;
      const next = actions.slice(i + 1).find((b) => b.workflow_state && b.workflow_state !== a.workflow_state);
      waits.push({ wait: a, resolution: next && !WAIT_STATES.has(next.workflow_state) ? next : null,
        followedBy: next || null });
    });
    return waits;
  }

  function renderTimeline(container, actions, violations, rules, headingLevel) {
    const byAction = new Map();
    const placed = new Set();
    for (const v of violations) {
      const key = v.span_id ? `span:${v.span_id}` : `action:${v.action_id}`;
      if (!byAction.has(key)) byAction.set(key, []);
      byAction.get(key).push(v);
    }
    const rows = [];
    actions.forEach((a, i) => {
      const own = [...(byAction.get(`span:${a.span_id}`) || []), ...(a.span_id ? [] : [])];
      // A violation without a span (log lines, deadlines) goes to the last record of its action.
      const isLast = !actions.slice(i + 1).some((b) => b.action_id === a.action_id);
      if (isLast) for (const v of byAction.get(`action:${a.action_id}`) || []) own.push(v);
      rows.push(el("tr", { class: own.length ? "action-row has-violation" : "action-row", id: `a-${i}`,
        "data-action": a.action_id || "" },
        el("td", {}, when(a.time_ns)),
        el("td", { class: "mono" }, a.action_id || "—"),
        el("td", {}, a.kind || "—"),
        el("td", {}, el("span", { class: `status st-${a.status}` }, a.status || "—")),
        el("td", {}, a.workflow_state ? el("span", { class: "state" }, a.workflow_state) : "—"),
        el("td", { class: "num" }, a.attempt ?? "—"),
        el("td", {}, a.keyed ? "yes" : "no")));
      for (const v of own) {
        placed.add(v.violation_id);
        rows.push(violationRow(v, rules));
      }
    });
    const loose = violations.filter((v) => !placed.has(v.violation_id));
    for (const v of loose) rows.push(violationRow(v, rules));
    const h = `h${headingLevel}`;
    container.append(el(h, {}, "Timeline"));
    container.append(table("Actions in order, each violation under the action it concerns",
      ["Time", "Action", "Kind", "Status", "Workflow state", "Attempt", "Idempotency key"], rows,
      "No actions kept for this session."));
    const waits = waitsOf(actions);
    container.append(el(h, {}, "Waits"));
    container.append(table("Waits and how they ended", ["Waiting in", "Action", "Since", "Ended by", "After"],
      waits.map((w) => el("tr", {},
        el("td", {}, el("span", { class: "state" }, w.wait.workflow_state)),
        el("td", { class: "mono" }, w.wait.action_id || "—"),
        el("td", {}, when(w.wait.time_ns)),
        el("td", {}, w.followedBy ? `${w.followedBy.workflow_state} (${w.followedBy.action_id || "?"})` : "still waiting"),
        el("td", {}, w.followedBy && w.wait.time_ns !== null && w.followedBy.time_ns !== null
          ? span((w.followedBy.time_ns - w.wait.time_ns) / 1e9).replace(" left", "") : "—"))),
      "No waits in this session."));
  }

  function violationRow(v, rules) {
    const rule = (rules || {})[v.rule] || {};
    // The fix in the input's language: span attributes and the annotate helper, or log fields.
    const fix = v.span_id ? rule.fix_spans : rule.fix_logs;
    const cell = el("td", { colspan: "7", class: "violation" },
      badge(v.severity), ...waivedMark(v), " ", el("strong", {}, `${v.rule} ${v.name || ""}`), ": ", v.message,
      fix ? el("div", { class: "fix" }, el("span", { class: "fix-label" }, "How to fix: "), fix) : null);
    return el("tr", { class: "violation-row", "data-rule": v.rule, "data-for": v.action_id || "" }, cell);
  }

  function renderSession(main, data, base) {
    const s = data.session;
    main.append(el("h1", {}, "Session ", el("span", { class: "mono" }, s.session_id)));
    const facts = el("dl", { class: "facts" },
      el("dt", {}, "Latest state"), el("dd", {}, s.state || "—"),
      el("dt", {}, "Actions"), el("dd", {}, s.actions),
      el("dt", {}, "Violations"), el("dd", {}, s.violations),
      el("dt", {}, "First seen"), el("dd", {}, when(s.first_ns)),
      el("dt", {}, "Last seen"), el("dd", {}, when(s.last_ns)),
      el("dt", {}, "Service"), el("dd", {}, s.service || "—"));
    if (s.replica_id) facts.append(el("dt", {}, "Evaluated by"), el("dd", {}, s.replica_id));
    if (s.wait) {
      const left = s.wait.deadline_ns === null ? null : (s.wait.deadline_ns - data.now_ns) / 1e9;
      facts.append(el("dt", {}, "Waiting"), el("dd", {},
        `${s.wait.state} since ${when(s.wait.since_ns)}, deadline ${when(s.wait.deadline_ns)} (${span(left)})`));
    }
    main.append(facts);
    const link = traceLink(data.setup, s.trace_id);
    if (link) main.append(el("p", {}, link));
    renderTimeline(main, data.actions, data.violations, data.rules, 2);
  }

  function renderPipeline(main, data) {
    main.append(el("h1", {}, "Pipeline"));
    main.append(el("p", { class: data.ready ? "ok" : "overdue" },
      data.ready ? "Ready: accepting spans." : `Not ready: ${data.not_ready_reason}`));
    const setup = data.setup || {};
    const kv = (pairs) => el("dl", { class: "facts" }, ...pairs.flatMap(([k, v]) => [el("dt", {}, k), el("dd", {}, v)]));
    const r = data.receivers;
    const sum = (o) => Object.values(o || {}).reduce((a, b) => a + b, 0);
    // "(awaiting_approval 2, waiting_on_external 1)": the states that have any.
    const waitStates = (o) => {
      const named = Object.entries(o || {}).filter(([, v]) => v > 0).map(([k, v]) => `${k} ${v}`);
      return named.length ? ` (${named.join(", ")})` : "";
    };
    main.append(el("h2", {}, "Receivers"), kv([
      ["Endpoints", (setup.receivers || []).join(", ") || "—"],
      ["Spans received", Object.entries(r.received).map(([k, v]) => `${k}: ${v}`).join(", ") || "0"],
      ["Spans rejected", `${sum(r.rejected)}`], ["Duplicates", `${r.duplicate}`], ["Late", `${r.late}`]]));
    main.append(el("h2", {}, "Queue and evaluation"), kv([
      ["Queue depth (requests)", `${data.queue.depth}`],
      ["Batches evaluated", `${data.evaluation.batches}`],
      ["Mean evaluation time", data.evaluation.mean_seconds === null ? "—" : `${(data.evaluation.mean_seconds * 1000).toFixed(2)} ms`],
      ["Open sessions", `${data.evaluation.open_sessions}`],
      ["Open waits", `${sum(data.evaluation.open_waits)}` + waitStates(data.evaluation.open_waits)],
      ["Past their deadline", `${sum(data.evaluation.expired_waits)}` + waitStates(data.evaluation.expired_waits)],
      ["Oldest open wait", `${Math.round(data.evaluation.oldest_open_wait_age_seconds)} s`]]));
    main.append(el("h2", {}, "State store"), kv([
      ["Backend", setup.state || "—"], ["Sessions in this view", `${data.sessions_in_view}`],
      ["Shown", setup.scope || "—"],
      ["Journal", `${data.state.journal_depth} request(s), ${data.state.journal_bytes} bytes`],
      ["Failures", `${sum(data.state.failures)}`],
      ["Sessions not restored at start", `${data.state.sessions_not_restored}`]]));
    main.append(el("h2", {}, "Exporters"), table("Exporters", ["Exporter", "Last delivery", "Sent", "Failed attempts", "Dropped", "Retry queue", "Outbox pending"],
      data.exporters.map((e) => el("tr", {}, el("td", {}, e.name),
        el("td", {}, e.last_success ? when(e.last_success * 1e9) : "never"),
        el("td", { class: "num" }, e.sent),
        el("td", { class: e.failures ? "overdue num" : "num" }, e.failures), el("td", { class: "num" }, e.dropped),
        el("td", { class: "num" }, e.queue_depth), el("td", { class: "num" }, e.outbox_pending))),
      "No exporter is configured."));
  }

  // -- the replay report (data embedded in the file) -------------------------------------------

  function renderReport(main, report) {
    main.append(el("h1", {}, "Durable Check replay report"));
    const s = report.summary || {};
    main.append(el("dl", { class: "facts" },
      el("dt", {}, "Inputs"), el("dd", {}, (report.inputs || []).join(", ") || "—"),
      el("dt", {}, "Sessions"), el("dd", {}, report.sessions.length),
      el("dt", {}, "Violations"), el("dd", {}, report.violations.length),
      el("dt", {}, "Actions"), el("dd", {}, s.actions ?? "—")));
    const counts = {};
    for (const v of report.violations) counts[v.rule] = (counts[v.rule] || 0) + 1;
    main.append(el("h2", {}, "Violations by rule"), table("Violations by rule", ["Rule", "Name", "Count"],
      Object.entries(counts).sort((a, b) => b[1] - a[1]).map(([rule, n]) => el("tr", {},
        el("td", { class: "mono" }, rule), el("td", {}, (report.rules[rule] || {}).name || ""), el("td", { class: "num" }, n))),
      "No violations: every session would survive a crash as far as the rules can tell."));
    // Input that could not be read (DS000 with no session): by input and line, apart from the sessions.
    const unread = report.violations.filter((v) => !v.session_id);
    if (unread.length) {
      main.append(el("h2", {}, "Lines that could not be read"), table("Lines that could not be read",
        ["Where", "Rule", "Message"], unread.map((v) => el("tr", { "data-rule": v.rule },
          el("td", { class: "mono" }, where(v)), el("td", { class: "mono" }, v.rule), el("td", {}, v.message))),
        "Every line was read."));
    }
    main.append(el("h2", {}, "Sessions"));
    const nav = el("ul", { class: "toc" });
    main.append(nav);
    report.sessions.forEach((session, i) => {
      const id = `session-${i}`;
      const mine = report.violations.filter((v) => v.session_id === session.session_id);
      nav.append(el("li", {}, el("a", { href: `#${id}` }, session.session_id), ` — ${mine.length} violation(s)`));
      const box = el("section", { id, class: "session", "aria-labelledby": `${id}-h`, "data-session": session.session_id });
      box.append(el("h3", { id: `${id}-h` }, "Session ", el("span", { class: "mono" }, session.session_id)));
      renderTimeline(box, session.actions || [], mine, report.rules, 4);
      main.append(box);
    });
    main.append(el("h2", {}, "All violations"), table("All violations",
      ["Severity", "Rule", "Session", "Action", "Message", "Time", "Where"],
      violationRows(report.violations, "#", true).map((row, i) => {
        // In a file there are no session pages: link to the session's section instead.
        for (const a of row.querySelectorAll("a")) {
          const at = report.sessions.findIndex((s) => s.session_id === a.textContent);
          a.setAttribute("href", at >= 0 ? `#session-${at}` : "#");
        }
        row.append(el("td", { class: "mono" }, where(report.violations[i])));
        return row;
      }), "No violations."));
  }

  // Where a violation's record was read: input and line for an action log, else the input alone.
  function where(v) {
    if (!v.origin) return "—";
    return v.line !== undefined && v.line !== null ? `${v.origin}:${v.line}` : v.origin;
  }

  // -- routing for the live view -------------------------------------------------------------

  async function getJson(url) {
    const answer = await fetch(url, { headers: { accept: "application/json" }, credentials: "same-origin" });
    const body = await answer.json();
    if (!answer.ok) throw new Error(body.error || `HTTP ${answer.status}`);
    return body;
  }

  function pagerFor(render, params, limit) {
    return (shown, total) => {
      const offset = Number(params.get("offset") || 0);
      const nav = el("nav", { class: "pager", "aria-label": "Pages" });
      const go = (to) => { params.set("offset", String(Math.max(0, to))); history.pushState(null, "", `?${params}`); render(); };
      const prev = el("button", { type: "button", disabled: offset === 0 }, "Previous page");
      prev.addEventListener("click", () => go(offset - limit));
      const more = total === null ? shown === limit : offset + shown < total;
      if (offset === 0 && !more) return document.createDocumentFragment();
      const next = el("button", { type: "button", disabled: !more }, "Next page");
      next.addEventListener("click", () => go(offset + limit));
      nav.append(prev, el("span", { class: "muted" }, `${offset + 1}–${offset + shown}`), next);
      return nav;
    };
  }

  async function route() {
    const main = document.getElementById("main");
    const path = location.pathname;
    const params = new URLSearchParams(location.search);
    const limit = 50;
    for (const a of document.querySelectorAll("nav[aria-label=Views] a")) {
      const current = (a.dataset.view === "waiting" && path === "/") || (a.dataset.view !== "waiting" && path.startsWith(`/${a.dataset.view}`));
      if (current) a.setAttribute("aria-current", "page"); else a.removeAttribute("aria-current");
    }
    const fresh = document.createElement("div");
    try {
      if (path.startsWith("/sessions/")) {
        const id = decodeURIComponent(path.slice("/sessions/".length));
        document.title = `Session ${id} — Durable Check`;
        renderSession(fresh, await getJson(`/api/v1/sessions/${encodeURIComponent(id)}`), "/");
      } else if (path === "/violations") {
        document.title = "Violations — Durable Check";
        const query = { rule: params.get("rule") || "", severity: params.get("severity") || "", session: params.get("session") || "" };
        const api = new URLSearchParams({ ...query, limit: String(limit), offset: params.get("offset") || "0" });
        api.set("session", query.session);
        const data = await getJson(`/api/v1/violations?${api}`);
        renderViolations(fresh, data, "/", query, (q) => {
          const next = new URLSearchParams(Object.entries(q).filter(([, v]) => v));
          history.pushState(null, "", `/violations?${next}`);
          route();
        }, pagerFor(route, params, limit));
      } else if (path === "/pipeline") {
        document.title = "Pipeline — Durable Check";
        renderPipeline(fresh, await getJson("/api/v1/pipeline"));
      } else {
        document.title = "Waiting now — Durable Check";
        const data = await getJson(`/api/v1/waiting?limit=${limit}&offset=${Number(params.get("offset") || 0)}`);
        renderWaiting(fresh, data, "/", pagerFor(route, params, limit));
      }
    } catch (error) {
      fresh.append(el("p", { class: "overdue", role: "alert" }, `Could not load this view: ${error.message}`));
    }
    main.replaceChildren(...fresh.childNodes);
    // Which address the content shows (a rendering finishes after its fetch, not at the click).
    main.dataset.shows = location.pathname + location.search;
  }

  const embedded = document.getElementById("report-data");
  if (embedded) {
    renderReport(document.getElementById("main"), JSON.parse(embedded.textContent));
  } else {
    window.addEventListener("popstate", route);
    route();
    // Waits come and go: Waiting now refreshes itself, but never under a keyboard user's focus.
    setInterval(() => {
      const focus = document.activeElement;
      const idle = !focus || focus === document.body || focus.id === "main";
      if (!document.hidden && idle && location.pathname === "/") route();
    }, 5000);
  }
})();
