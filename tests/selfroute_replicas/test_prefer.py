"""tests/selfroute/test_prefer.py with the machines on one replica and the consumers on another."""

from tests.selfroute.test_prefer import *  # noqa: F401,F403
