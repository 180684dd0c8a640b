package ckpt

import (
	"context"
	"errors"
	"fmt"
	"slices"
)

// Prune applies retention to job, per node of origin. For this node's own
// snapshots the newest keep are kept, and an older one is deleted only if
// some newer one is replicated, so the last replicated copy is never lost
// here. For copies received from another node (whose Replicas name the
// sender, which says nothing about this copy) the rule of PruneReceived
// applies, without a known-verified snapshot. The pinned snapshots (a run's
// coordinated snapshot) are kept whatever their age. It returns the ids it
// deleted.
func (s *Store) Prune(ctx context.Context, job string, keep int, pinned ...string) ([]string, error) {
	if keep < 1 {
		return nil, fmt.Errorf("prune %s: keep must be at least 1, got %d", job, keep)
	}
	ids, err := s.List(job, "")
	if err != nil {
		return nil, err
	}
	byNode := make(map[string][]string)
	var nodes []string
	for _, id := range ids { // newest first, so each group is too
		sid, _ := ParseID(id) // List only returns parseable ids
		if _, ok := byNode[sid.Node]; !ok {
			nodes = append(nodes, sid.Node)
		}
		byNode[sid.Node] = append(byNode[sid.Node], id)
	}
	var deleted []string
	var errs []error
	for _, node := range nodes {
		var d []string
		var err error
		if node == s.node {
			d, err = s.pruneOwn(ctx, job, byNode[node], keep, pinned)
		} else {
			d, err = s.pruneReceived(ctx, job, byNode[node], keep, "", pinned)
		}
		deleted = append(deleted, d...)
		if ctx.Err() != nil {
			return deleted, fmt.Errorf("prune %s: %w", job, ctx.Err())
		}
		if err != nil {
			errs = append(errs, err)
		}
	}
	return deleted, errors.Join(errs...)
}

// PruneReceived applies retention to the copies this store holds of job's
// snapshots taken on node (another node, which shipped them here): the
// newest keep are kept, and an older one is deleted only when a newer one
// verifies, so the newest copy that verifies is never deleted even if every
// copy newer than it turns out damaged. fresh names a snapshot verified
// moments ago (just received: Receive hashed it against its manifest), which
// counts as verified without hashing it again; copies newer than it are
// verified in full, which happens only when snapshots arrive out of order.
// It returns the ids it deleted.
func (s *Store) PruneReceived(ctx context.Context, job, node string, keep int, fresh string, pinned ...string) ([]string, error) {
	if keep < 1 {
		return nil, fmt.Errorf("prune %s: keep must be at least 1, got %d", job, keep)
	}
	if err := ValidName(node); err != nil {
		return nil, fmt.Errorf("prune %s: node: %w", job, err)
	}
	if node == s.node {
		return nil, fmt.Errorf("prune %s: %q is this node; its own snapshots are pruned with Prune", job, node)
	}
	ids, err := s.List(job, node)
	if err != nil {
		return nil, err
	}
	deleted, err := s.pruneReceived(ctx, job, ids, keep, fresh, pinned)
	if err != nil && ctx.Err() != nil {
		err = fmt.Errorf("prune %s: %w", job, ctx.Err())
	}
	return deleted, err
}

// pruneOwn applies the replicated rule to this node's snapshots (newest first).
func (s *Store) pruneOwn(ctx context.Context, job string, group []string, keep int, pinned []string) ([]string, error) {
	var deleted []string
	var errs []error
	newerReplicated := false
	for i, id := range group {
		if err := ctx.Err(); err != nil {
			return deleted, err
		}
		// An unreadable manifest counts as not replicated.
		m, merr := s.Manifest(job, id)
		if i >= keep && newerReplicated && !slices.Contains(pinned, id) {
			if err := s.Delete(job, id); err != nil {
				errs = append(errs, err)
				continue
			}
			s.log.Info("retention removed snapshot", "job", job, "id", id)
			deleted = append(deleted, id)
			continue
		}
		if merr == nil && m.Replicated() {
			newerReplicated = true
		}
	}
	return deleted, errors.Join(errs...)
}

// pruneReceived applies the verified rule to received copies (newest first).
func (s *Store) pruneReceived(ctx context.Context, job string, group []string, keep int, fresh string, pinned []string) ([]string, error) {
	if len(group) <= keep {
		return nil, nil // nothing to delete: spare the hashing
	}
	// The newest copy that verifies anchors retention: it and everything
	// newer stay.
	anchor := -1
	for i, id := range group {
		if id == fresh {
			anchor = i
			break
		}
		_, err := s.Verify(ctx, job, id)
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		if err == nil {
			anchor = i
			break
		}
		s.log.Warn("received snapshot copy does not verify; older copies are kept in its place", "job", job, "id", id, "err", err)
	}
	if anchor < 0 {
		s.log.Warn("no received copy verifies; retention deletes none", "job", job, "copies", len(group))
		return nil, nil
	}
	var deleted []string
	var errs []error
	for _, id := range group[max(keep, anchor+1):] {
		if err := ctx.Err(); err != nil {
			return deleted, err
		}
		if slices.Contains(pinned, id) {
			continue
		}
		if err := s.Delete(job, id); err != nil {
			errs = append(errs, err)
			continue
		}
		s.log.Info("retention removed received snapshot copy", "job", job, "id", id)
		deleted = append(deleted, id)
	}
	return deleted, errors.Join(errs...)
}
