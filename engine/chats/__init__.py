"""The chat mode: a place bound to one agent session, each message a turn.

- :mod:`engine.chats.records`: a place's binding and queued messages, and the
  :class:`~engine.chats.records.ChatQueue` a front end keeps them in.
- :mod:`engine.chats.sessions`: the mode itself (:class:`~engine.chats.sessions.ChatSessions`)
  and what it asks of a front end (:class:`~engine.chats.sessions.ChatFront`).
- :mod:`engine.chats.files`: the files of a place whose folder is on a worker.

Where the turns run is chosen by :func:`engine.executors.chat_agents`.
"""
