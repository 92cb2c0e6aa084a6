"""The resources server: tools with per-episode environment state and their idempotency,
an episode's saved record, its checkpoint participant and the final-state audit log
(``resources_server``, ``episode_record``, ``resources_participant``, ``final_state_log``)."""
