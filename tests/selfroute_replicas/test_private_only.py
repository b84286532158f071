"""tests/selfroute/test_private_only.py with the machines on one replica and the consumers on another."""

from tests.selfroute.test_private_only import *  # noqa: F401,F403
