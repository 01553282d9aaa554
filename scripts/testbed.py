#!/usr/bin/env python3
"""Run a command on an emulated multi-node cluster (Linux netns + veth + tc); see moeflow/testbed.py.

    sudo .venv/bin/python scripts/testbed.py --nodes 2 --ranks-per-node 2 --bandwidth-mbit 800 -- \\
        .venv/bin/moeflow profile --out results/profile-testbed.json
"""

import sys

from moeflow.testbed import main

if __name__ == "__main__":
    sys.exit(main())
