"""The one HTTP seam: every server is built by :mod:`.app`, every client goes through :mod:`.client`."""
