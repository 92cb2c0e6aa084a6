"""The model server: the OpenAI-compatible proxy in front of the policy, its call ledger and
its checkpoint participant (``model_server``, ``call_ledger``, ``model_participant``)."""
