pytest_plugins = ["tests.cluster_plugin"]
