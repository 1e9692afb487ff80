"""``lmtier route``: an OpenAI-compatible router in front of several engines that sends
each request to the one whose node holds the most of its prompt's prefix (docs/fleet.md)."""
