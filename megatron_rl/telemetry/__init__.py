"""TensorBoard, metrics.jsonl, console progress and the overlap timeline."""
