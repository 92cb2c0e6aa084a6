"""The agent server: ``/run`` plays task rows as episodes; its sessions, the session book,
the episode runner and its checkpoint participant (``agent_server``, ``session``,
``session_book``, ``episode_runner``, ``agent_participant``)."""
