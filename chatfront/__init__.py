"""What every chat front end shares, whatever its messenger: the rest is in ``bot/``.

- :mod:`chatfront.store`: what a chat front end must not lose, in the one database
  (inbound updates, the outbox and live messages, bindings and queued prompts, which
  message shows which gate, people, the chat audit), with its own migrations
  (:mod:`chatfront.migrations`; its tables keep the ``bot_`` prefix).
- :mod:`chatfront.auth`: who may do what (roles and actions).
- :mod:`chatfront.people`: how people are called in messages.
- :mod:`chatfront.outbox`: the one sender of the outbox, over a messenger's
  :class:`~chatfront.outbox.Transport` (its send and edit calls, its errors as ours).
- :mod:`chatfront.publish`: what is said, redacted, rendered by the messenger's
  :class:`~chatfront.render.Renderer` and queued; :mod:`chatfront.progress`: a turn's
  progress message; :mod:`chatfront.chat`: what the engine's chat mode asks of a chat;
  :mod:`chatfront.outgoing`: files of a run's folder sent into a chat.

Nothing here imports ``telegram`` or ``bot``; the engine imports nothing from here.
"""

__all__: list[str] = []
