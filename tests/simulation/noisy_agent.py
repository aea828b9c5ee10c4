"""A site agent whose code writes to its process's stdout, as a library's C code might
(tests/simulation/test_frames.py)."""

import os

from site_agent.agent import SiteAgent


class NoisyAgent(SiteAgent):
    def handle(self, stub, task):
        os.write(1, b"a stray line from a library, on file descriptor 1\n")
        print("and one from Python's print")
        return super().handle(stub, task)
