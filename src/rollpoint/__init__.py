"""rollpoint: checkpoint and recover in-flight multi-turn agent rollouts.

The package is split by which side of the wire a module lives on:

- ``protocol/``  wire models, ids and the error tree shared by both sides
- ``http/``      the one HTTP seam: app factory, client transport, auth
- ``participant/`` environment side: the participant SDK (public): hooks, fence, retire
  marks, gate, control routes, checkpoint writes, state images
- ``servers/``   environment side: the built-in model, agent and resources servers, each
  its own package, built only on ``participant/``
- ``envs/``      built-in environments (workplace, blackjack, math)
- ``policy/``    the scripted OpenAI-compatible policy
- ``trainer/``   RL side: ledger, dispatcher, finished-rollout queue, trainer loop
- ``store/``     snapshot store (the only place that knows about files)
- ``runtime/``   process launchers (the only place that knows about processes)
"""

__version__ = "0.1.0"
