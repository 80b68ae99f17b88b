"""Code that runs inside the vLLM server; this folder goes on the server's PYTHONPATH."""
