"""FAKE stand-in for the container's llmapi helpers.py (launch.sh copies it next to model.py); unused."""
