"""`plexus dashboard`: a live web view of the federation (app.py: the Starlette app; views.py: its JSON, pure
functions of the Admin service's replies; static/: the pages, their scripts and the vendored uPlot).

Starlette and uvicorn are the optional extra `plexus-fl[dashboard]`: only app.py imports them."""
