"""The Anthropic Messages API (`/v1/messages`) over the chat path."""
