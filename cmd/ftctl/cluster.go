package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"syscall"
	"time"

	"github.com/pelletier/go-toml/v2"

	"github.com/ftkit/ftkit/agent"
	"github.com/ftkit/ftkit/agentapi"
	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/clusterapi"
	"github.com/ftkit/ftkit/coordinated"
	"github.com/ftkit/ftkit/internal/cli"
	"github.com/ftkit/ftkit/internal/clustertls"
	"github.com/ftkit/ftkit/ring"
)

// Cluster mode: with --cluster FILE (or FTKIT_CLUSTER), ftctl talks to the agents' cluster listeners over
// mutual TLS with an operator certificate (clusterapi's operator operations) instead of one agent's local
// socket. It asks the first agent of the file that answers for the membership view, then every alive
// member.

// clusterEnv names the cluster configuration when neither --cluster, --socket nor --lab is given.
const clusterEnv = "FTKIT_CLUSTER"

// maxClusterConfig bounds the configuration file (a few agents and three paths).
const maxClusterConfig = 1 << 20

// clusterConfig is the cluster mode's configuration file (TOML).
type clusterConfig struct {
	// CA, Cert and Key are the cluster CA certificate, the operator's certificate and its key (ftctl pki
	// issue --operator); relative paths are relative to the file's directory.
	CA   string `toml:"ca"`
	Cert string `toml:"cert"`
	Key  string `toml:"key"`
	// CRL is optional: the CA's revocation list; an agent whose certificate it lists is refused.
	CRL string `toml:"crl"`
	// Agents are where to start: the first that answers gives the membership view.
	Agents []clusterSeed `toml:"agent"`
	// Timeout bounds each question to one agent (not a checkpoint or a restore); default 10s.
	Timeout string `toml:"timeout"`
}

// clusterSeed is one agent to start from: its member name (what its certificate says) and its cluster
// address ([cluster] listen of its configuration).
type clusterSeed struct {
	Name    string `toml:"name"`
	Address string `toml:"address"`
}

// loadClusterConfig reads and checks the configuration at path, and the operator's key file: it must be
// the caller's own and private (like ssh, a key others can read or replace is refused).
func loadClusterConfig(path string) (clusterConfig, time.Duration, error) {
	var cfg clusterConfig
	f, err := os.Open(path)
	if err != nil {
		return cfg, 0, cli.WithCode(cli.ExitUsage, fmt.Errorf("cluster configuration: %w", err))
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, maxClusterConfig+1))
	if err != nil {
		return cfg, 0, fmt.Errorf("read cluster configuration %s: %w", path, err)
	}
	if len(b) > maxClusterConfig {
		return cfg, 0, cli.Usagef("cluster configuration %s is larger than %d bytes", path, maxClusterConfig)
	}
	bad := func(format string, args ...any) error {
		return cli.Usagef("cluster configuration %s: %s (see `ftctl --help`)", path, fmt.Sprintf(format, args...))
	}
	d := toml.NewDecoder(bytes.NewReader(b))
	d.DisallowUnknownFields()
	if err := d.Decode(&cfg); err != nil {
		if se, ok := errors.AsType[*toml.StrictMissingError](err); ok {
			return cfg, 0, bad("unknown key: %s", se.String())
		}
		return cfg, 0, bad("%v", err)
	}
	dir := filepath.Dir(path)
	for name, p := range map[string]*string{"ca": &cfg.CA, "cert": &cfg.Cert, "key": &cfg.Key} {
		if *p == "" {
			return cfg, 0, bad("%s is missing", name)
		}
		if !filepath.IsAbs(*p) {
			*p = filepath.Join(dir, *p)
		}
	}
	if cfg.CRL != "" && !filepath.IsAbs(cfg.CRL) {
		cfg.CRL = filepath.Join(dir, cfg.CRL)
	}
	if len(cfg.Agents) == 0 {
		return cfg, 0, bad("no [[agent]] to start from: give at least one agent's name and address")
	}
	for _, s := range cfg.Agents {
		if err := clustertls.ValidateMemberName(s.Name); err != nil {
			return cfg, 0, bad("agent %q: %v", s.Name, err)
		}
		if _, port, err := net.SplitHostPort(s.Address); err != nil || port == "" {
			return cfg, 0, bad("agent %s: address %q: use HOST:PORT (the agent's [cluster] listen)", s.Name, s.Address)
		} else if _, err := strconv.ParseUint(port, 10, 16); err != nil {
			return cfg, 0, bad("agent %s: address %q: bad port", s.Name, s.Address)
		}
	}
	timeout := clusterapi.DefaultMessageTimeout
	if cfg.Timeout != "" {
		if timeout, err = time.ParseDuration(cfg.Timeout); err != nil || timeout <= 0 {
			return cfg, 0, bad("timeout %q: use a positive duration such as 10s", cfg.Timeout)
		}
	}
	if err := checkPrivateKey(cfg.Key); err != nil {
		return cfg, 0, err
	}
	return cfg, timeout, nil
}

// checkPrivateKey refuses a key file that is not the caller's or that others may read or write: an
// operator's key is a cluster-admin credential.
func checkPrivateKey(path string) error {
	fi, err := os.Stat(path)
	if err != nil {
		return cli.WithCode(cli.ExitUnavailable, fmt.Errorf("operator key: %w", err))
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	switch {
	case !fi.Mode().IsRegular():
		return cli.WithCode(cli.ExitUnavailable, fmt.Errorf("operator key %s is not a regular file", path))
	case !ok || int(st.Uid) != os.Getuid():
		return cli.WithCode(cli.ExitUnavailable, fmt.Errorf("operator key %s is not yours (owner uid %d, you are uid %d): an operator's key must belong to the operator", path, st.Uid, os.Getuid()))
	case fi.Mode().Perm()&0o077 != 0:
		return cli.WithCode(cli.ExitUnavailable, fmt.Errorf("operator key %s is accessible to other users (mode %04o): chmod 600 it (it is a cluster-admin credential)", path, fi.Mode().Perm()))
	}
	return nil
}

// clusterAgents reaches the agents of one cluster as an operator.
type clusterAgents struct {
	client  *clusterapi.Client
	timeout time.Duration
	addrs   map[string]string // member name -> cluster address: the seeds, then the view
}

func openCluster(path string) (*clusterAgents, []clusterSeed, error) {
	cfg, timeout, err := loadClusterConfig(path)
	if err != nil {
		return nil, nil, err
	}
	c := &clusterAgents{timeout: timeout, addrs: map[string]string{}}
	for _, s := range cfg.Agents {
		c.addrs[s.Name] = s.Address
	}
	tlsCfg := clustertls.Config{CAFile: cfg.CA, CertFile: cfg.Cert, KeyFile: cfg.Key, CRLFile: cfg.CRL}
	c.client = clusterapi.NewClient(clusterapi.ClientConfig{
		TLS: func() clustertls.Config { return tlsCfg },
		Resolve: func(name string) (string, bool) {
			a, ok := c.addrs[name]
			return a, ok
		},
		Timeouts: clusterapi.Timeouts{Message: timeout},
	})
	return c, cfg.Agents, nil
}

// clusterClients resolves --cluster to the alive members of the view the first answering seed gives (only
// host if set).
func (t *target) clusterClients(path string) ([]hostClient, error) {
	c, seeds, err := openCluster(path)
	if err != nil {
		return nil, err
	}
	var view []ring.Member
	var errs []error
	for _, s := range seeds {
		ctx, cancel := context.WithTimeout(context.Background(), c.timeout)
		st, err := (&clusterHost{c: c, name: s.Name}).Status(ctx)
		cancel()
		if err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", s.Name, err))
			continue
		}
		view = st.Members
		break
	}
	if view == nil {
		return nil, agentErr(fmt.Errorf("no agent of %s answered: %w", path, errors.Join(errs...)))
	}
	var out []hostClient
	for _, m := range view {
		if m.State != ring.StateAlive || (t.host != "" && m.Name != t.host) {
			continue
		}
		c.addrs[m.Name] = m.Address.String() // the view's address is the member's own
		out = append(out, hostClient{host: m.Name, client: &clusterHost{c: c, name: m.Name}})
	}
	if len(out) == 0 {
		return nil, cli.WithCode(cli.ExitNotFound, fmt.Errorf("the cluster has no alive member %q (see `ftctl status`)", t.host))
	}
	return out, nil
}

// clusterHost is one agent as an operator reaches it; it answers what the commands ask of an agent.
type clusterHost struct {
	c    *clusterAgents
	name string
}

var _ agentClient = (*clusterHost)(nil)

// Socket names the agent in messages: its member name and cluster address.
func (h *clusterHost) Socket() string { return h.name + " at " + h.c.addrs[h.name] }

// errOf says what a failed call means to the commands: the agent unreachable (exit 4), the job or
// snapshot not found there (exit 3), or the refusal or failure as it is.
func (h *clusterHost) errOf(err error) error {
	if e := clusterapi.Refusal(err); e != nil {
		if e.Code == clusterapi.CodeNotFound {
			return fmt.Errorf("%w: %s", agent.ErrNoJob, e.Message)
		}
		return err
	}
	if oe, ok := errors.AsType[*net.OpError](err); ok && oe.Op == "dial" {
		return fmt.Errorf("%w: agent %s: %v", agentapi.ErrAgentUnavailable, h.Socket(), oe.Err)
	}
	if errors.Is(err, context.DeadlineExceeded) {
		return fmt.Errorf("%w: agent %s did not answer in time: %v", agentapi.ErrAgentUnavailable, h.Socket(), err)
	}
	return err
}

// quick bounds a question that is not a checkpoint or a restore.
func (h *clusterHost) quick(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, h.c.timeout)
}

func decodeFrom[T any](h *clusterHost, what string, b json.RawMessage) (T, error) {
	var v T
	if err := json.Unmarshal(b, &v); err != nil {
		return v, fmt.Errorf("the %s from %s is not what ftctl expects (agent of another version?): %w", what, h.Socket(), err)
	}
	return v, nil
}

func (h *clusterHost) Status(ctx context.Context) (agent.Status, error) {
	ctx, cancel := h.quick(ctx)
	defer cancel()
	rep, err := h.c.client.OperatorStatus(ctx, h.name)
	if err != nil {
		return agent.Status{}, h.errOf(err)
	}
	return decodeFrom[agent.Status](h, "status", rep.Status)
}

func (h *clusterHost) Jobs(ctx context.Context) ([]agent.Job, error) {
	st, err := h.Status(ctx)
	return st.Jobs, err
}

func (h *clusterHost) Job(ctx context.Context, id string) (agent.Job, error) {
	js, err := h.Jobs(ctx)
	if err != nil {
		return agent.Job{}, err
	}
	for _, j := range js {
		if j.ID == id {
			return j, nil
		}
	}
	return agent.Job{}, fmt.Errorf("%w: %s on %s", agent.ErrNoJob, id, h.name)
}

func (h *clusterHost) Snapshots(ctx context.Context, job string) ([]*ckpt.Manifest, error) {
	ctx, cancel := h.quick(ctx)
	defer cancel()
	rep, err := h.c.client.OperatorSnapshots(ctx, h.name, clusterapi.OperatorSnapshotsRequest{Job: job})
	return rep.Snapshots, h.errOf(err)
}

func (h *clusterHost) Events(ctx context.Context) ([]*agent.Failure, error) {
	ctx, cancel := h.quick(ctx)
	defer cancel()
	rep, err := h.c.client.OperatorEvents(ctx, h.name)
	if err != nil {
		return nil, h.errOf(err)
	}
	return decodeFrom[[]*agent.Failure](h, "failure log", rep.Failures)
}

// Checkpoint and Restore take as long as the work does: the caller's context bounds them.
func (h *clusterHost) Checkpoint(ctx context.Context, jobs ...string) (agentapi.CheckpointReply, error) {
	rep, err := h.c.client.OperatorCheckpoint(ctx, h.name, clusterapi.OperatorCheckpointRequest{Jobs: jobs})
	if err != nil {
		return agentapi.CheckpointReply{}, h.errOf(err)
	}
	res, err := decodeFrom[[]agent.SnapshotResult](h, "checkpoint results", rep.Results)
	return agentapi.CheckpointReply{Results: res, Error: rep.Error}, err
}

func (h *clusterHost) Restore(ctx context.Context, req agent.RestoreRequest) (agent.Job, error) {
	rep, err := h.c.client.OperatorRestore(ctx, h.name, clusterapi.OperatorRestoreRequest{
		Snapshot: req.Snapshot, Job: req.Job, Source: req.Source, Force: req.Force})
	if err != nil {
		return agent.Job{}, h.errOf(err)
	}
	return decodeFrom[agent.Job](h, "restored job", rep.Job)
}

func (h *clusterHost) Migrate(ctx context.Context, req agent.MigrateRequest) (agent.Migration, error) {
	rep, err := h.c.client.OperatorMigrate(ctx, h.name, clusterapi.OperatorMigrateRequest{Job: req.Job, To: req.To})
	if err != nil {
		return agent.Migration{}, h.errOf(err)
	}
	return decodeFrom[agent.Migration](h, "migration", rep.Migration)
}

// errRunOpsLocal: coordinated snapshots and rollbacks are not operator operations over the cluster yet.
var errRunOpsLocal = errors.New("coordinated snapshots and rollbacks are asked of an agent's local socket (run ftctl on a member, as root); not over --cluster yet")

func (h *clusterHost) Cut(context.Context, coordinated.RunRequest) (coordinated.Cut, error) {
	return coordinated.Cut{}, errRunOpsLocal
}

func (h *clusterHost) Rollback(context.Context, coordinated.RunRequest) (coordinated.Rollback, error) {
	return coordinated.Rollback{}, errRunOpsLocal
}

func (h *clusterHost) Drain(ctx context.Context, req agent.DrainRequest) (agent.DrainResult, error) {
	rep, err := h.c.client.OperatorDrain(ctx, h.name, clusterapi.OperatorDrainRequest{To: req.To})
	if err != nil {
		return agent.DrainResult{}, h.errOf(err)
	}
	return decodeFrom[agent.DrainResult](h, "drain result", rep.Result)
}

// errLocalOnly refuses what operators are not served over the network: a job's output, its signals and
// spare registration stay with the host's local API (and its users' own credentials).
func (h *clusterHost) errLocalOnly(what string) error {
	return cli.Usagef("%s is not served to operators over the cluster network: run it on %s against its local socket", what, h.name)
}

func (h *clusterHost) Output(context.Context, string, string, bool, io.Writer) error {
	return h.errLocalOnly("a job's output (ftctl logs)")
}

func (h *clusterHost) Signal(context.Context, string, syscall.Signal) error {
	return h.errLocalOnly("signalling a job (ftctl kill)")
}

func (h *clusterHost) AddSpare(context.Context, agent.SpareRequest) (ring.View, error) {
	return ring.View{}, h.errLocalOnly("registering a spare (ftctl spare add)")
}
