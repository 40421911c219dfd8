"""An MCP server (stdio) with one tool, `calculate`: jrl's calculator.

    python jrl/envs/calculator_mcp.py

What `jrl.envs.word_problems.make_mcp_env` starts; needs the `mcp` extra.
The server declares the tool as MCP servers do (its argument schema from
the signature, with pydantic's titles); the description and the argument's
are the Python tool's, so the system prompts differ only by those titles.
"""

from typing import Annotated

from mcp.server.mcpserver import MCPServer
from pydantic import Field

from jrl.envs.arith import calculate as _calculate

server = MCPServer('calculator')
DESCRIPTION = 'Evaluates an arithmetic expression: numbers, + - * / // % ** and parentheses.'


@server.tool(description=DESCRIPTION)
def calculate(
  expression: Annotated[str, Field(description='the expression, e.g. 47*8+13.')],
) -> str:
  return _calculate(expression)


if __name__ == '__main__':
  server.run()
