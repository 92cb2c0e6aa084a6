"""The resources server: tools with per-episode environment state and their idempotency,
its HTTP app, an episode's saved record, its checkpoint participant and the final-state audit
log (``episode_service``, ``live_episode``, ``episode_install``, ``resources_server``,
``episode_record``, ``resources_participant``, ``final_state_log``)."""
