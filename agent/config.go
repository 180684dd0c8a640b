package agent

import "github.com/ftkit/ftkit/agentconfig"

// The agent's configuration is package agentconfig's; the daemon's API names its types as its own.
type (
	Config           = agentconfig.Config
	Member           = agentconfig.Member
	Role             = agentconfig.Role
	Mode             = agentconfig.Mode
	Duration         = agentconfig.Duration
	Interval         = agentconfig.Interval
	LogConfig        = agentconfig.LogConfig
	HealthConfig     = agentconfig.HealthConfig
	JobNetworkConfig = agentconfig.JobNetworkConfig
)

const (
	RoleNode        = agentconfig.RoleNode
	RoleSpare       = agentconfig.RoleSpare
	Uncoordinated   = agentconfig.Uncoordinated
	SemiCoordinated = agentconfig.SemiCoordinated
)
