"""The environment side: the participant SDK (fence, control routes) and the gym servers."""
