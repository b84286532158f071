"""tests/selfroute/test_pinning.py with the machines on one replica and the consumers on another."""

from tests.selfroute.test_pinning import *  # noqa: F401,F403
