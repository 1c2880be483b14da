"""The web inbox driven in a real browser (Playwright + Chromium) on the real stack."""
