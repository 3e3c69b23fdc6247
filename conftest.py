"""Project-wide pytest plugins: the skip policy applies to every test directory."""

pytest_plugins = ["tests.skip_policy"]
