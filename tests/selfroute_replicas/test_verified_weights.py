"""tests/selfroute/test_verified_weights.py with the machines on two replicas and the consumers on a third."""

from tests.selfroute.test_verified_weights import *  # noqa: F401,F403
