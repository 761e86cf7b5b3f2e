"""Repository-wide pytest configuration: this suite runs with the dsv4-oracle pytest plugin.

The plugin (:mod:`dsv4_oracle.pytest_plugin`) registers the markers (``gpu``, ``sm90``,
``sm100``, ``cudnn``, ``multigpu``, ``slow``, ``production``), skips hardware-marked tests with
the reason on machines that lack the hardware, keeps GPU tests in one xdist group and adds
``--replays``. When dsv4-oracle is installed its ``pytest11`` entry point has already loaded
the plugin under this same name, and pytest does not load it twice; in a checkout that is not
installed, this line loads it.
"""
pytest_plugins = ["dsv4_oracle.pytest_plugin"]
