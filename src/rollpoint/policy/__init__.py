"""The scripted policy: a deterministic, seeded OpenAI-compatible server for runs without a GPU.

``create_policy_app(PolicySettings(...))`` builds the FastAPI app; :class:`Playbook` is the
decision logic on its own (what the server answers for a given request).
"""

from rollpoint.policy.playbook import (
    Decision,
    Environment,
    FinalDecision,
    Mistake,
    Playbook,
    ToolCallDecision,
)
from rollpoint.policy.scripted_policy import PolicySettings, create_policy_app

__all__ = [
    "Decision",
    "Environment",
    "FinalDecision",
    "Mistake",
    "Playbook",
    "PolicySettings",
    "ToolCallDecision",
    "create_policy_app",
]
