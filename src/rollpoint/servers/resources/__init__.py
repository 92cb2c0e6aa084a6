"""The resources server: tools with per-episode environment state and their idempotency,
an episode's saved record and its checkpoint participant (``resources_server``,
``episode_record``, ``resources_participant``)."""
