package agent

import (
	"context"
	"fmt"
	"net/netip"
	"time"

	"github.com/ftkit/ftkit/clusterapi"
	"github.com/ftkit/ftkit/internal/clustertls"
	"github.com/ftkit/ftkit/ring"
)

// SpareRequest registers a spare host while jobs run. Its agent must already run with a certificate of the
// cluster CA whose common name is Name.
type SpareRequest struct {
	Name    string         `json:"name"`
	Address netip.AddrPort `json:"address"`
}

// AddSpare checks that the spare's agent answers as Name at Address, adds it to the spare pool (the end of
// the first-come-first-served order) in a new view, and sends that view to every member.
func (a *Agent) AddSpare(ctx context.Context, req SpareRequest) (ring.View, error) {
	if req.Name == "" || !req.Address.IsValid() {
		return ring.View{}, fmt.Errorf("a spare needs a name and an address ip:port")
	}
	if _, ok := a.member(req.Name); ok {
		return ring.View{}, fmt.Errorf("%s is already a member; a failed member whose host address nobody holds rejoins by itself once its agent runs (ring rejoin), otherwise a repaired host rejoins under a new name", req.Name)
	}
	pctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	// The spare is no member yet: a client of its own dials it at the address given, and trusts only it.
	pc := clusterapi.NewClient(clusterapi.ClientConfig{
		TLS: func() clustertls.Config {
			cfg := a.tlsConfig()
			cfg.Members = func(name string) bool { return name == req.Name }
			return cfg
		},
		Resolve:  func(name string) (string, bool) { return req.Address.String(), name == req.Name },
		Timeouts: a.wire,
		Logger:   a.log,
	})
	defer pc.Close()
	r, err := pc.Ping(pctx, req.Name)
	if err != nil {
		return ring.View{}, fmt.Errorf("the spare's agent does not answer as %s at %s (is ftagent running there with a certificate of this cluster's CA, and does its configuration list this member, %s?): %w", req.Name, req.Address, a.cfg.Name, err)
	}
	if len(r.Jobs) > 0 {
		return ring.View{}, fmt.Errorf("%s runs jobs %v: a spare must be idle", req.Name, r.Jobs)
	}
	// Onto the view as it is now (a view adopted since it was read would make the change stale).
	m := ring.Member{Name: req.Name, Address: req.Address, Role: ring.RoleSpare, State: ring.StateAlive}
	nv, err := a.updateView(func(cur ring.View) (ring.View, error) { return cur.AddSpare(m) })
	if err != nil {
		return ring.View{}, err
	}
	a.log.Info("spare registered", "spare", req.Name, "address", req.Address, "epoch", nv.Epoch)
	a.pushView(ctx)
	// The push may have brought back a view of the same epoch made elsewhere meanwhile (another failure,
	// another spare registered through another member) that won the tie-break without this spare: no
	// operation removes a member, so nothing else would ever add it back. Added again onto the winner now,
	// and for a while as a protector keeps a failure (keepFailedInView).
	a.reassertSpare(ctx, m)
	go a.keepSpareInView(context.WithoutCancel(ctx), m)
	return a.View(), nil
}

// keepSpareInView makes sure, for keepFailedFor, that the views keep spare m, registered here: a view of
// the same epoch that won the tie-break against its registration's is one without it.
func (a *Agent) keepSpareInView(ctx context.Context, m ring.Member) {
	for end := time.Now().Add(keepFailedFor); time.Now().Before(end); {
		select {
		case <-ctx.Done():
			return
		case <-time.After(keepFailedEvery):
		}
		if a.reassertSpare(ctx, m) {
			return
		}
	}
}

// reassertSpare adds spare m again if the current view has no member of its name (its registration's view
// lost a tie-break), and pushes the result; it reports whether it had to and could.
func (a *Agent) reassertSpare(ctx context.Context, m ring.Member) bool {
	if _, ok := a.View().Member(m.Name); ok {
		return false
	}
	nv, err := a.updateView(func(cur ring.View) (ring.View, error) { return cur.AddSpare(m) })
	if err != nil {
		a.log.Error("a spare registered here is gone from the view (another view of the same epoch won), and could not be added again", "spare", m.Name, "err", err)
		return false
	}
	a.log.Warn("a spare registered here was gone from the view (another view of the same epoch won): added again", "spare", m.Name, "epoch", nv.Epoch)
	a.pushView(ctx)
	return true
}
