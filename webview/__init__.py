"""The web view and Telegram Mini App over the runs: a front end like the bot, served by it."""
