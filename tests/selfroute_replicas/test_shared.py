"""tests/selfroute/test_shared.py with the machines on one replica and the consumers on another."""

from tests.selfroute.test_shared import *  # noqa: F401,F403
