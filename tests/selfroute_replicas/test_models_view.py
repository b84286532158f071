"""tests/selfroute/test_models_view.py with the machines on one replica and the consumers on another."""

from tests.selfroute.test_models_view import *  # noqa: F401,F403
