"""POST /v1/decide: service.py (the request, its prompt and labels, the rendered decision),
consumer.py. /v1/decisions, built on the same machinery, is apps/api/decisions.

The package re-exports service.py, so the names of the old decide.py module still resolve.
"""

from apps.api.decide.service import *  # noqa: F403
from apps.api.decide.service import ANSWER_LEAD, PreparedDecision, label_first_tokens  # noqa: F401
