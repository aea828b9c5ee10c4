"""Suite-wide settings: tests never write into the working directory."""

import tempfile

from hypothesis import configuration, settings

configuration.set_hypothesis_home_dir(tempfile.mkdtemp(prefix="plexus-hypothesis-"))
settings.register_profile("plexus", database=None)
settings.load_profile("plexus")
