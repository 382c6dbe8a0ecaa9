"""Running one rank's stages: the executor and stage runners, the boundary between stages, the Pipeline's protocols."""
