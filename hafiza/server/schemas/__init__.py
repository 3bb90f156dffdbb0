"""Pydantic request bodies of the two APIs the server speaks."""
