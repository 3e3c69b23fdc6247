"""Project-wide pytest plugins: the skip policy and the quick subset apply to every test directory."""

pytest_plugins = ["tests.skip_policy", "tests.quick_subset"]
