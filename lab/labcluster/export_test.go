package labcluster

import (
	"github.com/ftkit/ftkit/agent"
	"github.com/ftkit/ftkit/lab"
)

// The kernel objects a lab's agents use, for the tests that check Down removes them.
var (
	CgroupDir = cgroupDir
	PinDir    = pinDir
)

// ConfigOf is the agent configuration Start writes for host h of a lab in state st, with opts.
func ConfigOf(st lab.State, h lab.Host, opts Options) agent.Config {
	c := &Cluster{opts: opts}
	return c.config(st, h)
}
