"""Wire models, identities and errors shared by the trainer and the environment side."""
