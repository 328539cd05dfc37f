"""The attention API (`POST /v1/attention`) and the explorer page that draws it."""
