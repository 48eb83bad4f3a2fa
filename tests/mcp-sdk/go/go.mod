module guardmesh.test/mcp-upstream

go 1.19
