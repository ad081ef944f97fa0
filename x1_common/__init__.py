"""Small pieces every X1 service shares. Standard library only (httpx is imported lazily)."""
