"""What both HTTP services stand on: the uvicorn server with the project's deadlines and
lingering close (``server``) and the one error shape (``errors``)."""
