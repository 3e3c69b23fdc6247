"""Route: spans regrouped by the session they belong to, for a second hop that routes by session."""
