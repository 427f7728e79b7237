"""Glue to the engines people scale out with. Each module imports its engine only when used:
`minfer.integrations.ray` (Ray Data's `map_batches`; `pip install "minfer[ray]"`),
`minfer.integrations.diffusers` (a pipeline's `prompt_embeds=`; needs torch)."""
