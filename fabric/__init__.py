"""The Ray layer: Ray session, the Ray Data pipeline, and the Ray Train launcher and worker loop."""
