"""The scripted policy: a deterministic, seeded OpenAI-compatible server for runs without a GPU.

:class:`Playbook` is the decision logic on its own (what the server answers for a given
request); the server is :mod:`rollpoint.policy.scripted_policy`
(``create_policy_app(PolicySettings(...))`` builds its FastAPI app). The package does not
import the server: the trainer imports :mod:`rollpoint.policy.engine_adapters` (what each
engine's replies carry), and FastAPI is ~0.12 s of CPU in a process that serves nothing.
"""

from rollpoint.policy.playbook import (
    Decision,
    Environment,
    FinalDecision,
    Mistake,
    Playbook,
    ToolCallDecision,
)

__all__ = [
    "Decision",
    "Environment",
    "FinalDecision",
    "Mistake",
    "Playbook",
    "ToolCallDecision",
]
