"""What the tests share: helpers, fixtures' building blocks, model factories replica processes import."""
