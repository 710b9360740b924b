"""The built-in web page and the KV pool's live view it draws."""
