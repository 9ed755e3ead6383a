"""The operator's view: state file, history, load ETA, our Prometheus textfile, the vLLM tree."""
