"""tests/selfroute/test_loaded_models.py with the machines on two replicas and the consumers on a third."""

from tests.selfroute.test_loaded_models import *  # noqa: F401,F403
