"""Serving a target like an engine: a scheduler over DP ranks (`scheduler`, no torch import: the evals'
configuration check reads its policies) and the engine that runs its plans on a world, one forward per step,
with KV caches kept across steps (`engine`). The evals serve through it."""
