"""The code sandbox: runs model-written programs against tests in a bubblewrap jail, as its own service."""
