"""The dashboard's pages, one Streamlit script each (registered by ui/app.py)."""
